//! The supervisor: one task per owned (account, epoch), started on claim and stopped when the
//! account leaves the node's read-back set, is disabled, changes epoch, or a fenced write finds
//! it lost.
//!
//! Every stop closes the account's gate first (synchronously, inside [`Supervisor::apply`], before
//! any other account's deadline is extended), then cancels the task and waits for it to return
//! (its work in flight finishes), and only then, if the row is still ours, releases it. The lease
//! loop owns the supervisor and feeds it cycle results and [`Event`]s; nothing here blocks it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, error, info, info_span, warn};

use crate::account::{self, AccountContext, NodeServices};
use crate::db;
use crate::db::lease::OwnedRow;
use crate::gate::AccountGate;
use crate::handoff;
use crate::retry;
use crate::status_writer::{Lost, StatusWriter};
use crate::trust::MonoBase;

/// What the node shares with the supervisor.
#[derive(Debug, Clone)]
pub struct NodeShared {
    pub services: Arc<NodeServices>,
    pub status: StatusWriter,
    pub base: MonoBase,
    pub tracker: TaskTracker,
    /// The checks that announce a released account again if nobody claimed it within
    /// [`UNCLAIMED_AFTER`]: waited for when the node ends (a bounded wait), so that a stopping
    /// node's last hand-offs are checked too, after its leave.
    pub checks: TaskTracker,
    /// The parent of every account task's token: cancelled when the node ends, it stops any
    /// session still running then (each is normally stopped on its own, gate first).
    pub sessions: CancellationToken,
}

/// Things that happen to accounts outside a cycle; the lease loop passes them to [`Supervisor::handle`].
#[derive(Debug)]
pub enum Event {
    /// The task of (account, epoch) returned; `error` is set if it failed or panicked.
    Exited {
        account_id: i64,
        epoch: i64,
        error: Option<String>,
    },
    /// A release of (account, epoch) finished (or gave up; the next cycle retries it).
    Released { account_id: i64, epoch: i64 },
    /// The receiver of the hand-off of (account, epoch) answered that it will not claim (it has
    /// no room): a fair-share move is called off and the session, still copying behind its open
    /// gate, goes on; a shutdown's goes on stopping. (A receiver that does not answer in time
    /// may only be slow to log in ahead: the hand-off goes on, unprepared.)
    HandoffDeclined { account_id: i64, epoch: i64 },
    /// Time to restart a task that failed by itself.
    Restart { account_id: i64, epoch: i64 },
    /// The status writer found (account, epoch) no longer ours.
    Lost(Lost),
}

/// What the supervisor does to the world, apart from deciding: the node's account tasks and
/// release statements in production ([`NodeHost`]), the simulator's model of them in simulation.
/// The supervisor's decisions (which gate closes when, what is released after what) stay in one
/// place whichever host carries them out.
pub trait Host {
    /// What stops a session once started.
    type Session;
    /// The node's monotonic clock.
    fn now(&self) -> Instant;
    /// The base the gates encode their deadlines against.
    fn base(&self) -> MonoBase;
    /// Starts the session of (account, epoch) behind `gate`; it reports its end as
    /// [`Event::Exited`].
    fn start(&mut self, account_id: i64, epoch: i64, gate: Arc<AccountGate>) -> Self::Session;
    /// One cycle's claims are about to start these accounts' sessions ([`Host::start`] follows
    /// for each): a host may ask for what every one of them reads first, all at once. Nothing by
    /// default.
    fn starting_together(&mut self, _account_ids: &[i64]) {}
    /// A release announcement woke the node: the cycle about to run may claim the accounts it
    /// prepared for hand-offs. A host may ask now, beside the cycle, for what their sessions
    /// read first ([`Host::starting_together`] then takes it); [`Host::claims_over`] follows the
    /// cycle. Nothing by default.
    fn claims_soon(&mut self) {}
    /// The cycle [`Host::claims_soon`] announced is over: what it asked ahead for accounts the
    /// cycle did not claim is dropped (read before the cycle, it is used by that cycle's claims
    /// alone). Nothing by default.
    fn claims_over(&mut self) {}
    /// Starts a session again after it failed by itself, with the same gate and session handle.
    fn restart(&mut self, account_id: i64, gate: Arc<AccountGate>, session: &Self::Session);
    /// Asks a session to stop; it reports [`Event::Exited`] once its work in flight is done.
    fn cancel(&mut self, session: &Self::Session);
    /// Hands a running session's account off to `to` (fair share, or a shutdown: `leaving`):
    /// the host may keep the session copying behind its open `gate` while `to` prepares, then
    /// closes the gate and stops the session as [`Host::cancel`] does. By default: at once.
    fn hand_off(
        &mut self,
        _account_id: i64,
        gate: &Arc<AccountGate>,
        session: &Self::Session,
        _to: Option<&str>,
        _leaving: bool,
    ) {
        gate.close();
        self.cancel(session);
    }
    /// Every hand-off of one step (a shutdown's, one fair-share move's) has been asked
    /// ([`Host::hand_off`] for each): a host that keeps their sessions copying for their
    /// receivers may close their gates together, once every receiver has answered, and release
    /// them together. Nothing by default.
    fn handed_off_together(&mut self) {}
    /// The longest a handed-off session may copy on for its receiver ([`Host::hand_off`]).
    /// Zero by default (no waiting).
    fn handoff_wait(&self) -> Duration {
        Duration::ZERO
    }
    /// Releases (account, epoch) (fenced, announced to `to`, the hand-off's receiver, or to
    /// every peer); reports [`Event::Released`].
    fn release(&mut self, account_id: i64, epoch: i64, status: &'static str, to: Option<&str>);
    /// Reports [`Event::Restart`] for (account, epoch) after `delay` (the node's host adds up to
    /// half as long again, at random).
    fn restart_later(&mut self, account_id: i64, epoch: i64, delay: Duration);
    /// Shows a status text on the account row.
    fn status(&mut self, account_id: i64, epoch: i64, text: String);
    /// The database failed over: followers forget their masters' (epoch, seq) and reconcile.
    fn database_failed_over(&mut self);
    /// The lease loop reached the database again after failed cycles (connections waiting out a
    /// backoff may retry now). Nothing by default.
    fn database_back(&mut self) {}
    /// Sessions started and not yet through their start-up. None by default.
    fn starting(&self) -> usize {
        0
    }
}

/// The production host: account tasks on the runtime, releases over the pool.
#[derive(Debug)]
pub struct NodeHost {
    shared: NodeShared,
    events: mpsc::UnboundedSender<Event>,
    /// Hand-offs offered, by (account, epoch): `true` once the receiver answered that it will
    /// claim (the release then names it, and only it wakes: [`crate::channels::Release`]). The release takes the entry, so an answer arriving after
    /// it (the session ended on its own meanwhile) finds none and leaves none behind.
    claimed_by_receiver: Arc<std::sync::Mutex<HashMap<(i64, i64), Offered>>>,
    /// The step whose hand-offs are being asked ([`Host::handed_off_together`] seals it).
    forming: Option<Arc<handoff::Together>>,
    /// The rows asked for the sessions about to start ([`Host::starting_together`]), taken by
    /// their [`Host::start`].
    rows_asked: HashMap<i64, crate::db::copy::AccountRowAsked>,
    /// The rows of the accounts prepared for hand-offs, asked as a release woke the node
    /// ([`Host::claims_soon`]), for the sessions its next cycle's claims start.
    rows_ahead: HashMap<i64, crate::db::copy::AccountRowAsked>,
}

impl Host for NodeHost {
    type Session = CancellationToken;

    fn now(&self) -> Instant {
        Instant::now()
    }

    fn base(&self) -> MonoBase {
        self.shared.base
    }

    /// Asks for every starting session's row at once, before any of them is spawned: they go
    /// to the database together (one statement), where each session asking as it first ran
    /// sent the first alone and the rest behind it, a round trip later, on a hand-off's path.
    fn starting_together(&mut self, account_ids: &[i64]) {
        self.rows_asked.clear();
        let mut ask = Vec::new();
        for &id in account_ids {
            match self.rows_ahead.remove(&id) {
                // Read beside the claim (the row says nothing of who owns it).
                Some(asked) => {
                    self.rows_asked.insert(id, asked);
                }
                None => ask.push(id),
            }
        }
        self.rows_asked.extend(self.read_rows(ask));
    }

    fn claims_soon(&mut self) {
        let prepared = self.shared.services.handoffs.prepared();
        self.rows_ahead = self.read_rows(prepared).collect();
    }

    fn claims_over(&mut self) {
        self.rows_ahead.clear();
    }

    fn start(&mut self, account_id: i64, _epoch: i64, gate: Arc<AccountGate>) -> CancellationToken {
        let row = self.rows_asked.remove(&account_id);
        let cancel = self.shared.sessions.child_token();
        let ctx = AccountContext {
            account_id,
            gate,
            cancel: cancel.clone(),
            status: self.shared.status.clone(),
            node: self.shared.services.clone(),
            startup: self.shared.services.starting.begin(),
        };
        spawn_task(&self.shared.tracker, &self.events, ctx, row);
        cancel
    }

    fn restart(&mut self, account_id: i64, gate: Arc<AccountGate>, session: &CancellationToken) {
        let ctx = AccountContext {
            account_id,
            gate,
            cancel: session.clone(),
            status: self.shared.status.clone(),
            node: self.shared.services.clone(),
            startup: self.shared.services.starting.begin(),
        };
        spawn_task(&self.shared.tracker, &self.events, ctx, None);
    }

    fn cancel(&mut self, session: &CancellationToken) {
        session.cancel();
    }

    fn starting(&self) -> usize {
        self.shared.services.starting.count()
    }

    fn hand_off(
        &mut self,
        account_id: i64,
        gate: &Arc<AccountGate>,
        session: &CancellationToken,
        to: Option<&str>,
        leaving: bool,
    ) {
        let services = self.shared.services.clone();
        let (Some(to), false) = (to, services.handoffs.wait().is_zero()) else {
            gate.close();
            session.cancel();
            return;
        };
        let (gate, session, to) = (gate.clone(), session.clone(), to.to_string());
        let claimed_by_receiver = self.claimed_by_receiver.clone();
        let events = self.events.clone();
        let key = (account_id, gate.epoch());
        let together = self.forming.get_or_insert_with(Arc::default).clone();
        together.join(key);
        claimed_by_receiver.lock().expect("never poisoned").insert(
            key,
            Offered {
                claims: false,
                together: together.clone(),
            },
        );
        self.shared.tracker.spawn(
            async move {
                // The session copies on, behind its gate, until the receiver is ready.
                let answered =
                    crate::handoff::offer(&services, account_id, &to, leaving, &session).await;
                together.answered(key, answered == Some(false));
                if answered == Some(false) {
                    // The receiver said it will not claim (no room): the supervisor decides
                    // (a fair-share move is called off, a shutdown's hand-off stops here).
                    claimed_by_receiver
                        .lock()
                        .expect("never poisoned")
                        .remove(&key);
                    let _ = events.send(Event::HandoffDeclined {
                        account_id,
                        epoch: key.1,
                    });
                    debug!(account_id, to, "hand-off declined by its receiver");
                    return;
                }
                // Named only when the receiver said it will claim: a release named to a
                // receiver that did not answer in time (slow, paused, dead) would wake only it.
                if let Some(offered) = claimed_by_receiver
                    .lock()
                    .expect("never poisoned")
                    .get_mut(&key)
                {
                    offered.claims = answered == Some(true);
                }
                // It copies on until the step's other receivers answered too (their offers end
                // within the same wait): the step's gates close together.
                tokio::select! {
                    () = together.all_answered() => {}
                    () = session.cancelled() => {}
                    () = tokio::time::sleep(services.handoffs.wait()) => {}
                }
                gate.close();
                session.cancel();
                debug!(
                    account_id,
                    to, answered, "hand-off offer over: gate closed, session stopping"
                );
            }
            .in_current_span(),
        );
    }

    fn handed_off_together(&mut self) {
        if let Some(together) = self.forming.take() {
            together.seal();
        }
    }

    fn handoff_wait(&self) -> Duration {
        self.shared.services.handoffs.wait()
    }

    fn release(&mut self, account_id: i64, epoch: i64, status: &'static str, to: Option<&str>) {
        let releaser = self.shared.services.releaser.clone();
        let node_id: Arc<str> = self.shared.services.node_id.as_str().into();
        // Named only when the receiver said it will claim; otherwise a few peers with room wake.
        let offered = self
            .claimed_by_receiver
            .lock()
            .expect("never poisoned")
            .remove(&(account_id, epoch));
        let claims = offered.as_ref().is_some_and(|o| o.claims);
        let to = to.filter(|_| claims).map(str::to_string);
        let events = self.events.clone();
        let unclaimed = self.shared.services.unclaimed.clone();
        let checks = self.shared.checks.clone();
        let job = db::lease::Releasing {
            node_id: node_id.clone(),
            release: db::lease::Release {
                account_id,
                epoch,
                status: status.to_string(),
                to: to.clone(),
            },
        };
        // A hand-off whose gate closed with its step's: it goes with theirs.
        let mut together = offered.and_then(|o| {
            o.together
                .release((account_id, epoch), job.clone(), &releaser)
        });
        self.shared.tracker.spawn(async move {
            const ATTEMPTS: u32 = 5;
            let mut retry = retry::RELEASE.start();
            let mut released = false;
            for attempt in 1..=ATTEMPTS {
                // Gathered with the node's other releases of the moment: one statement.
                let result = match together.take() {
                    Some(handle) => match handle.await {
                        Ok(submitted) => submitted.outcome().await,
                        Err(_) => Err("the hand-offs released together were dropped".to_string()),
                    },
                    None => releaser.write(job.clone()).await,
                };
                match result {
                    Ok(false) => {
                        info!(account_id, epoch, "release found the account no longer ours; nothing to release");
                        break;
                    }
                    Ok(true) => {
                        info!(account_id, epoch, reason = status, "account released");
                        released = true;
                        break;
                    }
                    // A failed attempt that a retry may mend is no warning (a node shedding
                    // thousands of accounts at once would log one per account); the last is.
                    Err(e) => {
                        if attempt < ATTEMPTS {
                            debug!(account_id, epoch, attempt, error = %e, "release failed; retrying");
                        } else {
                            warn!(account_id, epoch, attempt, error = %e, "release failed after every attempt; a later cycle retries, or the lease runs out");
                        }
                        tokio::time::sleep(retry.failed()).await;
                    }
                }
            }
            let _ = events.send(Event::Released { account_id, epoch });
            // Its announcement woke only the receiver, or a few nodes with room: if none has
            // claimed it by now (the receiver stopped, paused or filled up since it answered;
            // the few woken had filled up or their notices were late), a few with room wake.
            // Also once the node has ended (a shutdown's hand-offs end in its leave): the node
            // waits for its checks before it exits.
            if released {
                checks.spawn(async move {
                    tokio::time::sleep(UNCLAIMED_AFTER).await;
                    let check = db::lease::Unclaimed {
                        node_id,
                        account_id,
                    };
                    match unclaimed.write(check).await {
                        Ok(true) => {
                            debug!(account_id, to, "nobody has claimed the released account: announced again, naming nobody");
                        }
                        Ok(false) => {}
                        // The account waits for a cycle of a node with room (a period at most).
                        Err(e) => {
                            debug!(account_id, to, error = %e, "announcing an unclaimed account again failed");
                        }
                    }
                });
            }
        });
    }

    fn restart_later(&mut self, account_id: i64, epoch: i64, delay: Duration) {
        // Up to half as long again, at random: sessions that failed together (a trade server
        // down, the database busy) do not all come back in the same instant.
        let delay = delay + delay.mul_f64(fastrand::f64() / 2.0);
        let events = self.events.clone();
        self.shared.tracker.spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = events.send(Event::Restart { account_id, epoch });
        });
    }

    fn status(&mut self, account_id: i64, epoch: i64, text: String) {
        self.shared.status.status(account_id, epoch, text);
    }

    fn database_failed_over(&mut self) {
        self.shared.services.hub.failed_over();
    }

    fn database_back(&mut self) {
        self.shared.services.hub.database_back();
    }
}

impl NodeHost {
    /// Asks for the rows of `ids` at once (one batch: [`crate::db::batch::BatchWriter::submit_all`]).
    fn read_rows(
        &self,
        ids: Vec<i64>,
    ) -> impl Iterator<Item = (i64, crate::db::copy::AccountRowAsked)> + use<> {
        let reads = ids
            .iter()
            .map(|&id| crate::db::copy::AccountRead(id))
            .collect();
        let asked = self.shared.services.accounts.submit_all(reads);
        ids.into_iter().zip(asked)
    }
}

/// A hand-off offered by this node ([`NodeHost::hand_off`]), until its release.
#[derive(Debug)]
struct Offered {
    /// The receiver answered that it will claim (the release then names it).
    claims: bool,
    /// The step it was asked in: its gate closes, and it is released, with the step's others.
    together: Arc<handoff::Together>,
}

/// How long after its release an account, if still free, is announced again naming nobody
/// ([`db::lease::announce_unclaimed`]): the named receiver, or the few nodes a release naming
/// no one wakes, claim within milliseconds of the announcement on a healthy database.
pub(crate) const UNCLAIMED_AFTER: Duration = Duration::from_secs(1);

/// The release status of a fair-share move.
const REBALANCED: &str = "released: rebalanced";

/// The release status of a shutdown's hand-off.
const SHUTDOWN: &str = "released: shutdown";

#[derive(Debug)]
struct Active<S> {
    epoch: i64,
    /// When this owner claimed the account (database clock): rebalancing moves the oldest first.
    claimed_ms: i64,
    gate: Arc<AccountGate>,
    session: S,
    /// The task is not running: it failed and waits for its restart.
    parked: bool,
    failures: u32,
}

#[derive(Debug)]
struct Stopping<S> {
    /// Release the row once the task has returned, with this status text.
    release: Option<&'static str>,
    /// As [`Active::claimed_ms`] (a fair-share move called off keeps its place).
    claimed_ms: i64,
    /// The hand-off's receiver, named in the release's announcement.
    to: Option<String>,
    since: Instant,
    /// Closed already, unless the session is handed off and still copying until its receiver
    /// is ready: then a shutdown or a lost row closes it.
    gate: Arc<AccountGate>,
    session: S,
}

/// Owns the account tasks of one node.
#[derive(Debug)]
pub struct Supervisor<H: Host = NodeHost> {
    host: H,
    active: HashMap<i64, Active<H::Session>>,
    stopping: HashMap<(i64, i64), Stopping<H::Session>>,
    releasing: HashSet<(i64, i64)>,
    shutting_down: bool,
}

impl Supervisor<NodeHost> {
    pub fn new(shared: NodeShared, events: mpsc::UnboundedSender<Event>) -> Self {
        Supervisor::with_host(NodeHost {
            shared,
            events,
            claimed_by_receiver: Arc::default(),
            forming: None,
            rows_asked: HashMap::new(),
            rows_ahead: HashMap::new(),
        })
    }
}

impl<H: Host> Supervisor<H> {
    pub fn with_host(host: H) -> Self {
        Supervisor {
            host,
            active: HashMap::new(),
            stopping: HashMap::new(),
            releasing: HashSet::new(),
            shutting_down: false,
        }
    }

    /// The host carrying out the decisions.
    pub fn host(&self) -> &H {
        &self.host
    }

    pub fn host_mut(&mut self) -> &mut H {
        &mut self.host
    }

    /// Applies a confirmed cycle: `owned` is everything the database says this node owns,
    /// `acknowledged` when the cycle's COMMIT was acknowledged and `deadline` its trust deadline.
    /// Gates of accounts no longer owned (or owned at a new epoch) close before this returns.
    /// Returns how many gates had lapsed and are trusted again (their tasks will reconcile).
    pub fn apply(&mut self, owned: &[OwnedRow], acknowledged: Instant, deadline: Instant) -> usize {
        let mut restored = 0;
        // Accounts missing from the read-back first: their gates close before any other gate
        // is extended.
        let seen: HashSet<i64> = owned.iter().map(|row| row.id).collect();
        let mut lost: Vec<i64> = self
            .active
            .keys()
            .filter(|id| !seen.contains(id))
            .copied()
            .collect();
        // Here and below in id order, not the maps': the simulator replays a seed exactly.
        lost.sort_unstable();
        for id in lost {
            warn!(
                account_id = id,
                epoch = self.active[&id].epoch,
                "account lost: no longer owned by this node; closing its gate and stopping its session"
            );
            self.stop(id, None);
        }
        // A session handed off and still copying for its receiver (its gate open): renewed
        // with its row at the same epoch, as a live session is (a shutdown's hand-offs too);
        // stopped at once when the row is gone, at another epoch, or disabled.
        let rows: HashMap<i64, &OwnedRow> = owned.iter().map(|r| (r.id, r)).collect();
        let mut stopping: Vec<_> = self.stopping.iter_mut().collect();
        stopping.sort_unstable_by_key(|(key, _)| **key);
        for ((id, epoch), stop) in stopping {
            if stop.gate.is_closed() {
                continue;
            }
            match rows.get(id) {
                Some(row) if row.epoch == *epoch && row.wanted => {
                    stop.gate.renew(acknowledged, deadline);
                }
                row => {
                    if row.is_some_and(|r| r.epoch == *epoch && !r.wanted) {
                        info!(
                            account_id = *id,
                            epoch = *epoch,
                            "account disabled or moved to another platform while handed off: closing its gate"
                        );
                        stop.release = Some("released: disabled");
                        stop.to = None;
                    } else {
                        warn!(
                            account_id = *id,
                            epoch = *epoch,
                            "account lost while handed off: closing its gate and stopping its session"
                        );
                    }
                    stop.gate.close();
                    self.host.cancel(&stop.session);
                }
            }
        }
        let mut starts = Vec::new();
        for row in owned {
            let key = (row.id, row.epoch);
            if self.stopping.contains_key(&key) || self.releasing.contains(&key) {
                continue;
            }
            match self.active.get(&row.id) {
                Some(a) if a.epoch == row.epoch => {
                    if row.wanted && !self.shutting_down {
                        if a.gate.renew(acknowledged, deadline) {
                            restored += 1;
                            info!(
                                account_id = row.id,
                                epoch = row.epoch,
                                "lease trust restored for the account after a lapse; it reconciles before acting"
                            );
                        }
                    } else if row.wanted {
                        // Shutting down: the gate stays closed; the row is released at the end.
                    } else {
                        info!(
                            account_id = row.id,
                            epoch = row.epoch,
                            "account disabled or moved to another platform: closing its gate and releasing it"
                        );
                        self.stop(row.id, Some("released: disabled"));
                    }
                    continue;
                }
                Some(a) => {
                    info!(
                        account_id = row.id,
                        old_epoch = a.epoch,
                        epoch = row.epoch,
                        "account re-claimed with a new epoch (its earlier lease had expired): restarting its session"
                    );
                    self.stop(row.id, None);
                }
                None => {}
            }
            if row.wanted && !self.shutting_down {
                starts.push((row.id, row.epoch, row.claimed_ms));
            } else if !row.wanted {
                info!(
                    account_id = row.id,
                    epoch = row.epoch,
                    "owned account is disabled or on another platform: releasing it"
                );
                self.release(row.id, row.epoch, "released: disabled", None);
            }
        }
        if !starts.is_empty() {
            let ids: Vec<i64> = starts.iter().map(|s| s.0).collect();
            self.host.starting_together(&ids);
        }
        for (id, epoch, claimed_ms) in starts {
            self.start(id, epoch, claimed_ms, deadline);
        }
        restored
    }

    /// Handles an event from a task, a release or the status writer.
    pub fn handle(&mut self, event: Event) {
        match event {
            Event::Exited {
                account_id,
                epoch,
                error,
            } => {
                if let Some(stop) = self.stopping.remove(&(account_id, epoch)) {
                    info!(
                        account_id,
                        epoch,
                        stopped_in_ms = (self.host.now() - stop.since).as_millis() as u64,
                        "account session stopped"
                    );
                    if let Some(status) = stop.release {
                        self.release(account_id, epoch, status, stop.to.as_deref());
                    }
                    return;
                }
                let Some(a) = self
                    .active
                    .get_mut(&account_id)
                    .filter(|a| a.epoch == epoch)
                else {
                    return;
                };
                // The task ended without being asked: keep the account (and its lease), show the
                // error, and restart with backoff, so one bad account never crash-loops the node.
                a.parked = true;
                a.failures += 1;
                let delay = restart_delay(a.failures);
                let reason = error.unwrap_or_else(|| "the session ended unexpectedly".into());
                error!(account_id, epoch, error = %reason, restart_in_s = delay.as_secs(), "account session failed; restarting it later");
                self.host
                    .status(account_id, epoch, format!("error: {reason} (restarting)"));
                self.host.restart_later(account_id, epoch, delay);
            }
            Event::Restart { account_id, epoch } => {
                if self.shutting_down {
                    return;
                }
                if let Some(a) = self
                    .active
                    .get_mut(&account_id)
                    .filter(|a| a.epoch == epoch && a.parked)
                {
                    a.parked = false;
                    info!(account_id, epoch, "restarting account session");
                    self.host.restart(account_id, a.gate.clone(), &a.session);
                }
            }
            Event::Released { account_id, epoch } => {
                self.releasing.remove(&(account_id, epoch));
            }
            Event::HandoffDeclined { account_id, epoch } => {
                let key = (account_id, epoch);
                let Some(stop) = self.stopping.get(&key).filter(|s| !s.gate.is_closed()) else {
                    // Stopped meanwhile (a shutdown, a lost row, the session's own end).
                    return;
                };
                if stop.release == Some(REBALANCED)
                    && !self.shutting_down
                    && !self.active.contains_key(&account_id)
                {
                    // The receiver said it cannot take the account: released, it would wait
                    // unowned for some node's cycle.
                    let stop = self.stopping.remove(&key).expect("looked up above");
                    info!(
                        account_id,
                        epoch,
                        to = stop.to.as_deref(),
                        "hand-off called off: the receiver answered that it will not claim; keeping the account (its session never stopped)"
                    );
                    self.active.insert(
                        account_id,
                        Active {
                            epoch,
                            claimed_ms: stop.claimed_ms,
                            gate: stop.gate,
                            session: stop.session,
                            parked: false,
                            failures: 0,
                        },
                    );
                    return;
                }
                stop.gate.close();
                self.host.cancel(&stop.session);
            }
            Event::Lost(Lost { account_id, epoch }) => {
                if let Some(stop) = self
                    .stopping
                    .get(&(account_id, epoch))
                    .filter(|s| !s.gate.is_closed())
                {
                    warn!(
                        account_id,
                        epoch,
                        "account lost while handed off: a fenced write matched no row; closing its gate"
                    );
                    stop.gate.close();
                    self.host.cancel(&stop.session);
                    return;
                }
                if self
                    .active
                    .get(&account_id)
                    .is_some_and(|a| a.epoch == epoch)
                {
                    warn!(
                        account_id,
                        epoch,
                        "account lost: a fenced write matched no row; closing its gate and stopping its session"
                    );
                    self.stop(account_id, None);
                }
            }
        }
    }

    /// Starts the shutdown: every gate closes now, every task is asked to stop. The rows are
    /// released by the lease loop once the tasks have returned.
    pub fn begin_shutdown(&mut self) {
        self.shutting_down = true;
        // In id order, not the map's: the simulator replays a seed exactly.
        let mut ids: Vec<i64> = self.active.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            self.stop(id, None);
        }
        // Sessions handed off and still copying for their receivers stop too.
        let mut stopping: Vec<_> = self.stopping.iter().collect();
        stopping.sort_unstable_by_key(|(key, _)| **key);
        for (_, stop) in stopping {
            if !stop.gate.is_closed() {
                stop.gate.close();
                self.host.cancel(&stop.session);
            }
        }
    }

    /// Starts a shutdown that hands accounts to the peers that can take them: the account the
    /// i-th oldest claimed goes to `receivers[i]` as a fair-share move does ([`Host::hand_off`]:
    /// copying on behind its open gate until the receiver is ready, then stopped and released on
    /// its own); the accounts without a receiver stop now (released when the node leaves).
    /// Sessions handed off before, still copying for their receivers, go on until they are.
    pub fn begin_shutdown_handing_off(&mut self, receivers: &[String]) {
        self.shutting_down = true;
        let mut ids: Vec<(i64, i64)> = self
            .active
            .iter()
            .map(|(id, a)| (a.claimed_ms, *id))
            .collect();
        ids.sort_unstable();
        for (i, (_, id)) in ids.into_iter().enumerate() {
            match receivers.get(i) {
                Some(to) => {
                    info!(
                        account_id = id,
                        to = to.as_str(),
                        "handing the account off (shutdown)"
                    );
                    self.hand_off(id, Some(to), true, SHUTDOWN);
                }
                None => self.stop(id, None),
            }
        }
        self.host.handed_off_together();
    }

    /// The longest a handed-off session copies on for its receiver.
    pub fn handoff_wait(&self) -> Duration {
        self.host.handoff_wait()
    }

    /// Hands off `n` accounts, oldest-claimed first (fair share): each is stopped (gate closed,
    /// work in flight finished) and then released and announced, so an under-share peer claims it
    /// and its new session reconciles. Returns the accounts chosen.
    pub fn rebalance(&mut self, n: usize, to: &[String]) -> Vec<i64> {
        let mut candidates: Vec<(i64, i64)> = self
            .active
            .iter()
            .map(|(id, a)| (a.claimed_ms, *id))
            .collect();
        candidates.sort_unstable();
        let chosen: Vec<i64> = candidates.into_iter().take(n).map(|(_, id)| id).collect();
        for (i, id) in chosen.iter().enumerate() {
            let to = to.get(i).map(String::as_str);
            info!(
                account_id = *id,
                to, "handing the account off to rebalance (fair share)"
            );
            self.hand_off(*id, to, false, REBALANCED);
        }
        self.host.handed_off_together();
        chosen
    }

    /// The database failed over: every session that follows masters forgets their (epoch, seq)
    /// and reconciles.
    pub fn database_failed_over(&mut self) {
        self.host.database_failed_over();
    }

    /// The lease loop reached the database again after failed cycles.
    pub fn database_back(&mut self) {
        self.host.database_back();
    }

    /// A release announcement woke the lease loop, whose next cycle may claim what this node
    /// prepared ([`Host::claims_soon`]).
    pub fn claims_soon(&mut self) {
        self.host.claims_soon();
    }

    /// That cycle is over ([`Host::claims_over`]).
    pub fn claims_over(&mut self) {
        self.host.claims_over();
    }

    /// True when no task runs or stops and no release is in flight.
    pub fn is_idle(&self) -> bool {
        self.active.is_empty() && self.stopping.is_empty() && self.releasing.is_empty()
    }

    /// Epochs whose tasks have not returned yet (their rows must not be released).
    pub fn unfinished_epochs(&self) -> HashSet<i64> {
        self.active
            .values()
            .filter(|a| !a.parked)
            .map(|a| a.epoch)
            .chain(self.stopping.keys().map(|(_, e)| *e))
            .collect()
    }

    /// Sessions handed off and still copying until their receivers are ready (gates open):
    /// still this node's, counted with its accounts for fair share.
    pub fn handing_off(&self) -> usize {
        self.stopping
            .values()
            .filter(|s| !s.gate.is_closed())
            .count()
    }

    /// Sessions started and not yet through their start-up ([`Host::starting`]).
    pub fn starting(&self) -> usize {
        self.host.starting()
    }

    /// How many accounts have a live session ([`Supervisor::owned`]'s length, without the map).
    pub fn running(&self) -> usize {
        self.active.len()
    }

    /// Accounts with a live session: id -> epoch.
    pub fn owned(&self) -> BTreeMap<i64, i64> {
        self.active.iter().map(|(id, a)| (*id, a.epoch)).collect()
    }

    /// The gate of an account's current epoch, if it has one: its live session's, or a
    /// handed-off session's still copying until its receiver is ready.
    pub fn gate(&self, account_id: i64) -> Option<Arc<AccountGate>> {
        self.active
            .get(&account_id)
            .map(|a| a.gate.clone())
            .or_else(|| {
                self.stopping
                    .iter()
                    .find(|((id, _), s)| *id == account_id && !s.gate.is_closed())
                    .map(|(_, s)| s.gate.clone())
            })
    }

    fn start(&mut self, account_id: i64, epoch: i64, claimed_ms: i64, deadline: Instant) {
        info!(account_id, epoch, "account claimed: starting its session");
        let gate = Arc::new(AccountGate::new(
            account_id,
            epoch,
            self.host.base(),
            deadline,
        ));
        let session = self.host.start(account_id, epoch, gate.clone());
        self.active.insert(
            account_id,
            Active {
                epoch,
                claimed_ms,
                gate,
                session,
                parked: false,
                failures: 0,
            },
        );
    }

    /// Closes the gate now, asks the task to stop; the release (if any) follows its return.
    fn stop(&mut self, account_id: i64, release: Option<&'static str>) {
        let Some(a) = self.active.remove(&account_id) else {
            return;
        };
        a.gate.close();
        self.host.cancel(&a.session);
        self.stopped(account_id, a, release, None);
    }

    /// Hands the account off to `to` (`leaving`: this node shuts down), released with `release`
    /// once its task has returned: the host may keep the session copying until `to` is ready
    /// (see [`Host::hand_off`]).
    fn hand_off(
        &mut self,
        account_id: i64,
        to: Option<&str>,
        leaving: bool,
        release: &'static str,
    ) {
        let Some(a) = self.active.remove(&account_id) else {
            return;
        };
        if a.parked {
            a.gate.close();
            self.host.cancel(&a.session);
        } else {
            self.host
                .hand_off(account_id, &a.gate, &a.session, to, leaving);
        }
        self.stopped(account_id, a, Some(release), to);
    }

    /// The account's task was asked to stop: released with `release` (announced to `to`, if
    /// named) once it has returned.
    fn stopped(
        &mut self,
        account_id: i64,
        a: Active<H::Session>,
        release: Option<&'static str>,
        to: Option<&str>,
    ) {
        if a.parked {
            // No task is running: nothing in flight to wait for.
            if let Some(status) = release {
                self.release(account_id, a.epoch, status, to);
            }
            return;
        }
        self.stopping.insert(
            (account_id, a.epoch),
            Stopping {
                release,
                claimed_ms: a.claimed_ms,
                to: to.map(str::to_string),
                since: self.host.now(),
                gate: a.gate,
                session: a.session,
            },
        );
    }

    /// Releases (account, epoch) in the background; fenced, announced to `to` or every peer.
    fn release(&mut self, account_id: i64, epoch: i64, status: &'static str, to: Option<&str>) {
        if !self.releasing.insert((account_id, epoch)) {
            return;
        }
        self.host.release(account_id, epoch, status, to);
    }
}

/// Spawns an account's task; `row`: its row, asked for already.
fn spawn_task(
    tracker: &TaskTracker,
    events: &mpsc::UnboundedSender<Event>,
    ctx: AccountContext,
    row: Option<crate::db::copy::AccountRowAsked>,
) {
    let account_id = ctx.account_id;
    let epoch = ctx.epoch();
    let span = info_span!("account", account_id, epoch);
    let inner = tracker.spawn(account::run(ctx, row).instrument(span));
    let events = events.clone();
    tracker.spawn(async move {
        let error = match inner.await {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(format!("{e:#}")),
            Err(join) if join.is_panic() => Some("the session panicked".to_string()),
            Err(_) => Some("the session was cancelled".to_string()),
        };
        let _ = events.send(Event::Exited {
            account_id,
            epoch,
            error,
        });
    });
}

/// Delay before the n-th restart of a failing account task (n >= 1).
pub(crate) fn restart_delay(failures: u32) -> Duration {
    retry::SESSION_RESTART.delay(failures)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status_writer;

    /// A supervisor whose database is never reached (the pool connects lazily to nowhere).
    fn supervisor() -> (Supervisor, mpsc::UnboundedReceiver<Event>) {
        supervisor_offering(Duration::ZERO)
    }

    /// As [`supervisor`], its fair-share hand-offs waiting up to `wait` for a receiver (none
    /// answers: the database is never reached).
    fn supervisor_offering(wait: Duration) -> (Supervisor, mpsc::UnboundedReceiver<Event>) {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_millis(50))
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .unwrap();
        let pool = crate::db::Db::direct(pool);
        let (lost_tx, _lost_rx) = mpsc::unbounded_channel();
        let (status, _writer) = status_writer::spawn(
            pool.clone(),
            "n".into(),
            lost_tx.clone(),
            CancellationToken::new(),
        );
        let (tx, rx) = mpsc::unbounded_channel();
        let options: sqlx::postgres::PgConnectOptions =
            "postgres://nobody@127.0.0.1:1/none".parse().unwrap();
        let services = Arc::new(NodeServices {
            node_id: "n".into(),
            orders: Arc::default(),
            copy_ledger: crate::db::copy::ledger::CopyLedgerWriter::spawn(pool.clone()),
            master_publisher: crate::db::copy::MasterPublisher::spawn(pool.clone()),
            links: crate::db::copy::LinksReader::spawn_background(pool.clone()),
            releaser: crate::db::lease::Releaser::spawn_pooled(pool.clone()),
            unclaimed: crate::db::lease::UnclaimedAnnouncer::spawn_pooled(pool.clone()),
            handoff_notices: crate::db::lease::HandoffAnnouncer::spawn_pooled(pool.clone()),
            accounts: crate::db::copy::AccountReader::spawn_background(pool.clone()),
            reconciles: crate::db::copy::ReconcileReader::spawn_background(pool.clone()),
            ledger_reads: crate::db::copy::LedgerReader::spawn_background(pool.clone()),
            master_states: crate::db::copy::MasterStateReader::spawn_background(pool.clone()),
            db: pool,
            hub: crate::hub::Hub::spawn(
                options,
                "mt5".into(),
                "n".into(),
                Arc::new(crate::hub::Wake::default()),
                CancellationToken::new(),
            ),
            brokers: Arc::new(crate::brokers::Brokers::new("n")),
            lost: lost_tx,
            metrics: Arc::new(crate::metrics::Metrics::new()),
            credentials_key: None,
            reconcile_every: Duration::from_secs(180),
            handoffs: crate::session::Handoffs::new("n", wait),
            starting: crate::session::Starting::new(prometheus::IntGauge::new("s", "s").unwrap()),
        });
        let shared = NodeShared {
            services,
            status,
            base: MonoBase::new(),
            tracker: TaskTracker::new(),
            checks: TaskTracker::new(),
            sessions: CancellationToken::new(),
        };
        (Supervisor::new(shared, tx), rx)
    }

    fn row(id: i64, epoch: i64, wanted: bool) -> OwnedRow {
        OwnedRow {
            id,
            epoch,
            wanted,
            claimed_ms: id * 10,
        }
    }

    #[tokio::test]
    async fn rebalancing_hands_off_the_oldest_claimed_first() {
        let (mut sup, _rx) = supervisor();
        let now = Instant::now();
        sup.apply(
            &[row(3, 13, true), row(1, 11, true), row(2, 12, true)],
            now,
            now + Duration::from_secs(2),
        );
        let first = sup.gate(1).unwrap();
        assert_eq!(sup.rebalance(2, &[]), vec![1, 2]);
        assert!(first.is_closed());
        assert_eq!(sup.owned(), BTreeMap::from([(3, 13)]));
    }

    #[tokio::test]
    async fn a_new_epoch_closes_the_old_gate_and_opens_a_new_one() {
        let (mut sup, _rx) = supervisor();
        let now = Instant::now();
        sup.apply(
            &[row(1, 10, true), row(2, 11, true)],
            now,
            now + Duration::from_secs(2),
        );
        let old = sup.gate(1).unwrap();
        let other = sup.gate(2).unwrap();
        assert!(old.holds() && other.holds());
        sup.apply(&[row(1, 12, true)], now, now + Duration::from_secs(3));
        assert!(
            !old.holds(),
            "the task holding epoch 10 is refused once epoch 12 exists"
        );
        assert!(
            !other.holds(),
            "an account missing from the read-back is closed"
        );
        let new = sup.gate(1).unwrap();
        assert_eq!(new.epoch(), 12);
        assert!(new.holds());
        assert!(sup.gate(2).is_none());
        assert_eq!(sup.owned(), BTreeMap::from([(1, 12)]));
    }

    /// A session handed off for fair share copies on behind its open gate while its receiver
    /// prepares: renewed with its row like a live one, and closed at once by whatever would have
    /// stopped a live one (its row lost or disabled, a fenced write matching nothing, a
    /// shutdown), never left open by them.
    #[tokio::test]
    async fn a_handed_off_session_copies_on_until_anything_would_stop_it() {
        let now = Instant::now();
        let at = |s: u64| now + Duration::from_secs(s);
        let handed_off = |sup: &mut Supervisor| {
            sup.apply(
                &[row(1, 10, true), row(2, 11, true), row(3, 12, true)],
                now,
                at(2),
            );
            let gates: Vec<Arc<AccountGate>> = (1..=3).map(|id| sup.gate(id).unwrap()).collect();
            let to = vec!["b".to_string(); 3];
            assert_eq!(sup.rebalance(3, &to), vec![1, 2, 3]);
            assert!(gates.iter().all(|g| g.holds()), "still copying");
            assert_eq!(sup.handing_off(), 3);
            assert!(sup.owned().is_empty());
            gates
        };
        let (mut sup, _rx) = supervisor_offering(Duration::from_secs(60));
        let gates = handed_off(&mut sup);
        // A renewal at the same epoch extends them (no lapse while the receiver logs in); a
        // row disabled, or gone, closes its gate.
        sup.apply(&[row(1, 10, true), row(2, 11, false)], now, at(5));
        assert_eq!(gates[0].deadline(), Some(at(5)));
        assert!(gates[1].is_closed() && gates[2].is_closed());
        assert_eq!(sup.stopping[&(2, 11)].release, Some("released: disabled"));
        assert_eq!(sup.handing_off(), 1);
        assert_eq!(sup.gate(1).map(|g| g.epoch()), Some(10));
        // Re-claimed at a new epoch (its lease had expired): the old gate closes.
        sup.apply(&[row(1, 13, true)], now, at(6));
        assert!(gates[0].is_closed());
        assert_eq!(sup.gate(1).map(|g| g.epoch()), Some(13));

        let (mut sup, _rx) = supervisor_offering(Duration::from_secs(60));
        let gates = handed_off(&mut sup);
        sup.handle(Event::Lost(Lost {
            account_id: 1,
            epoch: 10,
        }));
        assert!(gates[0].is_closed() && gates[1].holds());
        sup.begin_shutdown();
        assert!(gates.iter().all(|g| g.is_closed()));
        assert_eq!(sup.handing_off(), 0);

        // Without a wait the gates close at once, as before.
        let (mut sup, _rx) = supervisor();
        sup.apply(&[row(1, 10, true)], now, at(2));
        let gate = sup.gate(1).unwrap();
        sup.rebalance(1, &["b".to_string()]);
        assert!(gate.is_closed());
    }

    #[tokio::test]
    async fn a_disabled_account_is_released_only_after_its_task_returned() {
        let (mut sup, mut rx) = supervisor();
        let now = Instant::now();
        sup.apply(&[row(1, 10, true)], now, now + Duration::from_secs(2));
        let gate = sup.gate(1).unwrap();
        sup.apply(&[row(1, 10, false)], now, now + Duration::from_secs(3));
        assert!(gate.is_closed(), "the gate closes at once");
        assert!(
            sup.releasing.is_empty(),
            "no release while the task may still be finishing work"
        );
        assert!(sup.stopping.contains_key(&(1, 10)));
        // The task was cancelled; it reports its exit.
        let exited = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(
            exited,
            Event::Exited {
                account_id: 1,
                epoch: 10,
                ..
            }
        ));
        sup.handle(exited);
        assert!(
            sup.releasing.contains(&(1, 10)),
            "released once the task returned"
        );
        assert!(!sup.is_idle());
    }

    #[tokio::test]
    async fn a_lost_report_for_an_old_epoch_changes_nothing() {
        let (mut sup, _rx) = supervisor();
        let now = Instant::now();
        sup.apply(&[row(1, 12, true)], now, now + Duration::from_secs(2));
        sup.handle(Event::Lost(Lost {
            account_id: 1,
            epoch: 10,
        }));
        assert!(sup.gate(1).unwrap().holds());
        sup.handle(Event::Lost(Lost {
            account_id: 1,
            epoch: 12,
        }));
        assert!(sup.gate(1).is_none());
    }

    #[tokio::test]
    async fn shutdown_closes_every_gate_at_once() {
        let (mut sup, _rx) = supervisor();
        let now = Instant::now();
        sup.apply(
            &[row(1, 10, true), row(2, 11, true)],
            now,
            now + Duration::from_secs(2),
        );
        let gates = [sup.gate(1).unwrap(), sup.gate(2).unwrap()];
        sup.begin_shutdown();
        assert!(gates.iter().all(|g| g.is_closed()));
        assert_eq!(sup.unfinished_epochs(), HashSet::from([10, 11]));
        // A later cycle during shutdown starts nothing new.
        sup.apply(&[row(3, 13, true)], now, now + Duration::from_secs(2));
        assert!(sup.gate(3).is_none());
    }

    /// A shutdown with receivers: each account with one copies on behind its open gate (renewed
    /// with its row, as the node's cycles go on while it drains) and is released on its own once
    /// stopped; the rest close at once and wait for the node's leave.
    #[tokio::test]
    async fn a_shutdown_hands_off_what_peers_can_take_and_closes_the_rest() {
        let now = Instant::now();
        let at = |s: u64| now + Duration::from_secs(s);
        let (mut sup, _rx) = supervisor_offering(Duration::from_secs(60));
        sup.apply(
            &[row(1, 10, true), row(2, 11, true), row(3, 12, true)],
            now,
            at(2),
        );
        let gates: Vec<Arc<AccountGate>> = (1..=3).map(|id| sup.gate(id).unwrap()).collect();
        sup.begin_shutdown_handing_off(&["b".to_string(), "c".to_string()]);
        assert!(
            gates[0].holds() && gates[1].holds(),
            "handed off: still copying"
        );
        assert!(gates[2].is_closed(), "no receiver: closed at once");
        assert_eq!(sup.handing_off(), 2);
        assert_eq!(sup.stopping[&(1, 10)].release, Some("released: shutdown"));
        assert_eq!(
            sup.stopping[&(3, 12)].release,
            None,
            "released when the node leaves"
        );
        // A cycle while draining renews the handed-off gates and starts nothing new.
        sup.apply(
            &[
                row(1, 10, true),
                row(2, 11, true),
                row(3, 12, true),
                row(4, 13, true),
            ],
            now,
            at(5),
        );
        assert_eq!(gates[0].deadline(), Some(at(5)));
        assert!(sup.gate(4).is_none());
        // Their sessions stop once the receivers are ready: each released on its own.
        sup.handle(Event::Exited {
            account_id: 1,
            epoch: 10,
            error: None,
        });
        assert!(sup.releasing.contains(&(1, 10)));
        // A second, immediate shutdown (the node id taken over) closes what still copies.
        sup.begin_shutdown();
        assert!(gates[1].is_closed());
        assert_eq!(sup.handing_off(), 0);
    }

    /// What a host was asked to do, in order.
    #[derive(Debug, Default)]
    struct Recording {
        base: MonoBase,
        calls: Vec<String>,
    }

    impl Host for Recording {
        type Session = i64;
        fn now(&self) -> Instant {
            Instant::now()
        }
        fn base(&self) -> MonoBase {
            self.base
        }
        fn start(&mut self, account_id: i64, epoch: i64, _gate: Arc<AccountGate>) -> i64 {
            self.calls.push(format!("start {account_id}@{epoch}"));
            account_id
        }
        fn starting_together(&mut self, account_ids: &[i64]) {
            self.calls
                .push(format!("starting together {account_ids:?}"));
        }
        fn restart(&mut self, account_id: i64, _gate: Arc<AccountGate>, _session: &i64) {
            self.calls.push(format!("restart {account_id}"));
        }
        fn cancel(&mut self, session: &i64) {
            self.calls.push(format!("cancel {session}"));
        }
        fn release(
            &mut self,
            account_id: i64,
            epoch: i64,
            _status: &'static str,
            _to: Option<&str>,
        ) {
            self.calls.push(format!("release {account_id}@{epoch}"));
        }
        fn restart_later(&mut self, _account_id: i64, _epoch: i64, _delay: Duration) {}
        fn status(&mut self, _account_id: i64, _epoch: i64, _text: String) {}
        fn database_failed_over(&mut self) {}
    }

    /// The sessions one cycle starts are named to the host together, before the first of them
    /// starts (the node's host asks for all their rows at once there), and only those: not an
    /// account renewed as it is, nor one released as disabled. A cycle that starts nothing names
    /// nothing.
    #[tokio::test]
    async fn the_sessions_a_cycle_starts_are_named_together_before_any_starts() {
        let mut sup = Supervisor::with_host(Recording::default());
        let now = Instant::now();
        let until = now + Duration::from_secs(2);
        sup.apply(&[row(1, 11, true), row(2, 12, true)], now, until);
        // 1 renewed, 2 re-claimed with a new epoch, 3 claimed, 4 disabled, 5 claimed.
        sup.apply(
            &[
                row(1, 11, true),
                row(2, 22, true),
                row(3, 13, true),
                row(4, 14, false),
                row(5, 15, true),
            ],
            now,
            until,
        );
        sup.apply(
            &[row(1, 11, true), row(3, 13, true), row(5, 15, true)],
            now,
            until,
        );
        assert_eq!(
            sup.host().calls,
            [
                "starting together [1, 2]",
                "start 1@11",
                "start 2@12",
                "cancel 2",
                "release 4@14",
                "starting together [2, 3, 5]",
                "start 2@22",
                "start 3@13",
                "start 5@15",
                "cancel 2",
            ]
        );
    }

    #[test]
    fn restarts_back_off_to_a_cap() {
        assert_eq!(restart_delay(1), Duration::from_secs(1));
        assert_eq!(restart_delay(2), Duration::from_secs(2));
        assert_eq!(restart_delay(4), Duration::from_secs(8));
        assert_eq!(restart_delay(40), retry::SESSION_RESTART.max);
    }
}
