//! Prepared hand-offs (fair share, and a shutdown's): the receiving node logs the account in ahead of the release,
//! while the old owner still copies, so the new owner's first order waits for a fence raise and
//! its reads instead of a whole broker login (hundreds of milliseconds on a real trade server).
//!
//! Nothing here grants or reserves anything: the old owner O offers the account on
//! [`crate::channels::HANDOFF`] to the node it expects to claim it (the most starved peer), keeps
//! copying with its gate open until that node answers or [`crate::session::Handoffs::wait`] passes (a
//! fair-share move whose receiver answers that it will not claim is called off there), then stops
//! as before (gate closed, orders in flight finished, release committed and announced: naming R
//! when R answered that it will claim, so R's lease loop alone cycles at once; still free a
//! second later, the account is announced again naming no one). The claim is today's: whoever
//! claims first wins. The receiver R logs in **without a fence** (the
//! old owner's orders still pass at a fencing server) and holds the login; R's account task,
//! once its claim committed, raises the fence to its epoch with the bridge's `fence` request and
//! then starts its session. Where the bridge promises an ordered stream (`ordered_stream` in its
//! `hello`: a change made before a request reaches the connection before that request's reply),
//! R also reads the account's pending orders, positions, history and the server's symbols while
//! prepared ([`crate::broker::PreparedLogin::read_ahead`]); the changes its stream carries up to
//! the fence's reply (which follows the old owner's last order, since that order was answered
//! before the release and the release before the claim) bring them current, and the session
//! starts from them without a read of the trade server. Its reads of the database (links, the
//! masters' snapshots, the copy ledger) stay after the claim: the old owner's last ledger rows
//! are in only at its release. A login nobody claims is logged out after [`KEPT`]; a broker that
//! cannot prepare (FIX, a bridge without `fence`) leaves today's path.
//!
//! What keeps two owners from both sending is unchanged: R can send nothing before its claim
//! (the prepared login is not a [`crate::broker::Session`] until raised), and its claim cannot
//! commit before O's release. A SIGTERM hand-off is prepared the same way, one offer per account
//! to the peer that will take it ([`crate::lease::Core::begin_shutdown`]). The hand-offs one step
//! asks for (a shutdown's, one fair-share move's) go together ([`Together`]): their gates close
//! once every receiver of the step has answered, and their releases go in one statement.

use std::time::Duration;

use anyhow::Context;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::broker::{AccountLogin, PreparedLogin};
use crate::channels::Handoff;
use crate::credentials;
use crate::db;
use crate::hub::{Signal, Topic};
use crate::session::NodeServices;
use crate::session::handoffs::Entry;

/// How long a prepared login waits for its account's claim before it is logged out.
pub const KEPT: Duration = Duration::from_secs(10);

/// The most logins a node holds prepared at once (offers beyond it are answered unprepared): as
/// many sessions as it may start at once (`lease::STARTING_AT_ONCE`, held equal there), which
/// bounds what it claims at a time. (It was 256: a SIGTERM of 5,000 accounts over three peers
/// then moved about four in five of them unprepared.)
pub const MAX_PREPARED: usize = 1000;

/// The longest a prepared login may take (a slower broker gets no preparation).
const PREPARE_WITHIN: Duration = Duration::from_secs(10);

/// How long the releases of hand-offs whose gates closed together ([`Together`]) wait for a
/// member whose session is slow to stop (an order still on its way to a slow trade server):
/// the others then go without it. About what a second release and claim cost on a hand-off's
/// path under its load (a release statement, its announcement, the receiver's claim: each a
/// few milliseconds when traced on a two-core machine), so waiting longer would cost the
/// others more than the straggler's own statement does.
pub const TOGETHER_WITHIN: Duration = Duration::from_millis(5);

/// The hand-offs one step asked for together (a shutdown's, one fair-share move's): each session
/// copies on until every receiver of the step has answered (or its offer's wait passed), then
/// their gates close together, and their releases, once their sessions stopped, go to the
/// releaser as one batch. A hand-off's gap (from the old owner's gate closing to the new owner's
/// first order) is then one release, one claim and one start for the whole step, where accounts
/// answered a moment apart went through them in waves, each a statement behind the last: a
/// trade in any of those gaps was late for the followers caught in it.
///
/// Nothing here grants anything: a gate closes later than it would alone (its session copies
/// on meanwhile, as the owner), and a release still comes only after its session stopped.
#[derive(Debug, Default)]
pub struct Together {
    state: std::sync::Mutex<TogetherState>,
    /// Fired once the step is sealed and every member's offer is over.
    answered: CancellationToken,
}

#[derive(Debug, Default)]
struct TogetherState {
    /// Every member of the step has joined ([`Together::seal`]).
    sealed: bool,
    /// Members whose offer is not over yet.
    unanswered: usize,
    /// Members whose gates close together (one whose receiver declined leaves).
    members: std::collections::HashSet<(i64, i64)>,
    /// Members whose gates closed together and whose releases have not come yet.
    closing: std::collections::HashSet<(i64, i64)>,
    /// Releases that came, waiting for the rest: each job and where its handle goes.
    releases: Vec<(db::lease::Releasing, oneshot::Sender<ReleaseHandle>)>,
}

/// A release handed to the releaser ([`Together::release`]): its outcome when awaited.
pub type ReleaseHandle = db::batch::Submitted<bool>;

impl Together {
    fn state(&self) -> std::sync::MutexGuard<'_, TogetherState> {
        self.state.lock().expect("never poisoned")
    }

    /// (account, epoch) is offered as part of this step.
    pub fn join(&self, key: (i64, i64)) {
        let mut state = self.state();
        state.unanswered += 1;
        state.members.insert(key);
    }

    /// Every member has joined: once their offers are over, their gates close.
    pub fn seal(&self) {
        let mut state = self.state();
        state.sealed = true;
        self.check(&mut state);
    }

    /// The offer of `key` is over (answered, declined, or its wait passed). A member whose
    /// receiver declined leaves the step: its session goes on, or stops on its own.
    pub fn answered(&self, key: (i64, i64), declined: bool) {
        let mut state = self.state();
        state.unanswered = state.unanswered.saturating_sub(1);
        if declined {
            state.members.remove(&key);
        }
        self.check(&mut state);
    }

    fn check(&self, state: &mut TogetherState) {
        if state.sealed && state.unanswered == 0 && !self.answered.is_cancelled() {
            state.closing = state.members.clone();
            self.answered.cancel();
        }
    }

    /// Returns once every member's offer is over.
    pub async fn all_answered(&self) {
        self.answered.cancelled().await;
    }

    /// The release of `key`, a member whose gate closed with the others': it goes with the
    /// other members' once they all came (or [`TOGETHER_WITHIN`] after the first). `None` when
    /// it goes alone (not closed with the others, or they went already).
    pub fn release(
        self: &std::sync::Arc<Self>,
        key: (i64, i64),
        job: db::lease::Releasing,
        releaser: &db::lease::Releaser,
    ) -> Option<oneshot::Receiver<ReleaseHandle>> {
        let mut state = self.state();
        if !state.closing.remove(&key) {
            return None;
        }
        let (tx, rx) = oneshot::channel();
        state.releases.push((job, tx));
        if state.closing.is_empty() {
            Self::send(&mut state, releaser);
        } else if state.releases.len() == 1 {
            let (together, releaser) = (self.clone(), releaser.clone());
            tokio::spawn(async move {
                tokio::time::sleep(TOGETHER_WITHIN).await;
                let mut state = together.state();
                if !state.closing.is_empty() {
                    debug!(
                        waiting_for = state.closing.len(),
                        "releasing the hand-offs closed together without the sessions still stopping"
                    );
                }
                state.closing.clear();
                Self::send(&mut state, &releaser);
            });
        }
        Some(rx)
    }

    fn send(state: &mut TogetherState, releaser: &db::lease::Releaser) {
        if state.releases.is_empty() {
            return;
        }
        let (jobs, handles): (Vec<_>, Vec<_>) =
            std::mem::take(&mut state.releases).into_iter().unzip();
        for (submitted, handle) in releaser.submit_all(jobs).into_iter().zip(handles) {
            let _ = handle.send(submitted);
        }
    }
}

/// Offers `account_id` to `to` and waits, the session still copying, for `to`'s answer, at most
/// [`crate::session::Handoffs::wait`], or until `stopped` fires (the session was stopped for good: shutdown, a
/// lost lease). `leaving`: this node is shutting down (`to` was chosen by the shares without
/// it, so `to` takes the account below its capacity, at its own share or not). `Some(true)` when
/// `to` answered that it will claim the account (it has room and is not shutting down),
/// `Some(false)` when it answered that it will not; `None` without an answer in time (or from an
/// older node, whose answer says nothing of claiming).
pub async fn offer(
    node: &NodeServices,
    account_id: i64,
    to: &str,
    leaving: bool,
    stopped: &CancellationToken,
) -> Option<bool> {
    let handoffs = &node.handoffs;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let wait = async {
        let _subscription = node
            .hub
            .subscribe(Topic::HandoffAnswer(account_id), tx)
            .await?;
        let offer = Handoff {
            ready: false,
            account_id,
            from: handoffs.node_id().to_string(),
            to: to.to_string(),
            claims: None,
            leaving,
        };
        if let Err(e) = node
            .handoff_notices
            .write(db::lease::HandoffNotice(offer.payload()))
            .await
        {
            warn!(account_id, to, error = %e, "could not offer the account to the receiving node; handing it off unprepared");
            return None;
        }
        while let Some(signal) = rx.recv().await {
            if let Signal::Handoff(h) = signal
                && h.ready
                && h.account_id == account_id
                && h.to == to
            {
                return Some(h.claims);
            }
        }
        None
    };
    tokio::select! {
        answered = tokio::time::timeout(handoffs.wait(), wait) => match answered.ok().flatten() {
            Some(claims) => claims,
            None => {
                info!(account_id, to, wait_ms = handoffs.wait().as_millis() as u64, "the receiving node did not answer the hand-off offer in time; handing off anyway");
                None
            }
        },
        _ = stopped.cancelled() => None,
    }
}

/// Runs the receiving side until `shutdown`: prepares a login for every account offered to this
/// node, answers the offer, and logs out what is not claimed within [`KEPT`]. A node shutting
/// down answers at once and prepares nothing.
pub async fn serve(node: std::sync::Arc<NodeServices>, shutdown: CancellationToken) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let Some(_subscription) = node.hub.subscribe(Topic::HandoffOffers, tx).await else {
        return;
    };
    loop {
        let signal = tokio::select! {
            _ = shutdown.cancelled() => return,
            s = rx.recv() => match s {
                Some(s) => s,
                None => return,
            },
        };
        let Signal::Handoff(offer) = signal else {
            continue;
        };
        if offer.ready {
            continue;
        }
        let node = node.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            prepare(&node, &offer, &shutdown).await;
        });
    }
}

/// A login made ahead of a claim: how long it took, and whether the account was read too (why
/// not, if not).
struct Prepared {
    login: Box<dyn PreparedLogin>,
    login_ms: u64,
    read_ahead: Result<(), String>,
}

/// Prepares one offered account's login, answers the offer, and drops the login if nobody took
/// it within [`KEPT`].
async fn prepare(node: &NodeServices, offer: &Handoff, shutdown: &CancellationToken) {
    let account_id = offer.account_id;
    let handoffs = &node.handoffs;
    let generation = handoffs.next_generation();
    let (done, ready) = oneshot::channel();
    let started = tokio::time::Instant::now();
    let prepared = async {
        if shutdown.is_cancelled() {
            anyhow::bail!("this node is shutting down");
        }
        if !node.hub.takes(offer.leaving) {
            // It would answer that it will not claim: a login would be for nothing.
            if offer.leaving {
                anyhow::bail!(
                    "no room here (at its capacity, its last cycle late, or its share not yet counted)"
                );
            }
            anyhow::bail!("no room here (at its fair share, counting it, or its last cycle late)");
        }
        let held = handoffs.held();
        if held >= MAX_PREPARED {
            anyhow::bail!("{held} logins already prepared (at most {MAX_PREPARED})");
        }
        let row = node
            .read_account(account_id)
            .await
            .map_err(|e| anyhow::anyhow!("reading the account row: {e}"))?
            .with_context(|| format!("account {account_id} no longer exists"))?;
        let password = row
            .credentials
            .as_ref()
            .map(|stored| credentials::decrypt(node.credentials_key.as_ref(), stored))
            .transpose()
            .with_context(|| format!("account {account_id} cannot log in to {}", row.server))?;
        handoffs.hold(
            account_id,
            Entry {
                generation,
                server: row.server.clone(),
                login: row.login.clone(),
                ready,
            },
        );
        let account = AccountLogin {
            login: row.login.clone(),
            password,
            fence: None,
            account_id: Some(account_id),
        };
        let broker = node.brokers.broker(&row.server);
        let deadline = tokio::time::Instant::now() + PREPARE_WITHIN;
        let mut login = tokio::time::timeout_at(deadline, broker.prepare(&account))
            .await
            .map_err(|_| anyhow::anyhow!("no login within {PREPARE_WITHIN:?}"))??;
        let login_ms = started.elapsed().as_millis() as u64;
        // The account's orders, positions, history and symbols too, so that the session
        // starts from them after its claim instead of reading. A broker that cannot keep them
        // current leaves the session to read, as after any login.
        let read_ahead = match tokio::time::timeout_at(deadline, login.read_ahead()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no read within {PREPARE_WITHIN:?}")),
        };
        Ok(Prepared {
            login,
            login_ms,
            read_ahead,
        })
    };
    let outcome: anyhow::Result<Prepared> = prepared.await;
    let prepared_ms = started.elapsed().as_millis() as u64;
    match outcome {
        Ok(Prepared {
            login,
            login_ms,
            read_ahead,
        }) => {
            match &read_ahead {
                Ok(()) => info!(
                    account_id,
                    from = %offer.from,
                    login_ms,
                    prepared_ms,
                    "hand-off offered: logged in and read ahead of the claim (no fence: nothing can be sent until the claim raises it)"
                ),
                Err(why) => info!(
                    account_id,
                    from = %offer.from,
                    login_ms,
                    prepared_ms,
                    not_read = %why,
                    "hand-off offered: logged in ahead of the claim, not read (the session reads after its claim; no fence: nothing can be sent until the claim raises it)"
                ),
            }
            node.metrics
                .handoff_logins
                .with_label_values(&["prepared"])
                .inc();
            let _ = done.send(Some(login));
        }
        Err(e) => {
            node.metrics
                .handoff_logins
                .with_label_values(&["failed"])
                .inc();
            info!(account_id, from = %offer.from, error = %format!("{e:#}"), "hand-off offered: not prepared; the account logs in as usual when claimed");
            handoffs.forget(account_id, generation);
            let _ = done.send(None);
        }
    }
    // Read as the answer leaves: the receiver's share may have changed while it logged in.
    let answer = Handoff {
        ready: true,
        claims: Some(!shutdown.is_cancelled() && node.hub.takes(offer.leaving)),
        ..offer.clone()
    };
    if let Err(e) = node
        .handoff_notices
        .write(db::lease::HandoffNotice(answer.payload()))
        .await
    {
        debug!(account_id, error = %e, "could not answer the hand-off offer (the old owner stops waiting at its bound)");
    }
    tokio::select! {
        _ = tokio::time::sleep(KEPT) => {}
        _ = shutdown.cancelled() => {}
    }
    if handoffs.forget(account_id, generation) {
        node.metrics
            .handoff_logins
            .with_label_values(&["unused"])
            .inc();
        info!(
            account_id,
            "prepared login not claimed here in time: logged out"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `together`'s members may close their gates now.
    fn all_answered(together: &Together) -> bool {
        futures_util::FutureExt::now_or_never(together.all_answered()).is_some()
    }

    #[test]
    fn a_steps_gates_close_once_it_is_sealed_and_every_offer_is_over() {
        let together = Together::default();
        let (a, b, c) = ((1, 10), (2, 20), (3, 30));
        together.join(a);
        together.join(b);
        together.answered(a, false);
        together.answered(b, false);
        assert!(
            !all_answered(&together),
            "not sealed: more of the step may still join"
        );
        together.join(c);
        together.seal();
        assert!(!all_answered(&together), "c's offer is not over");
        together.answered(c, true);
        assert!(all_answered(&together));
        // The members that close together are those whose receivers did not decline.
        let closing = together.state().closing.clone();
        assert_eq!(
            closing,
            [a, b].into_iter().collect(),
            "c's receiver declined: its session goes on (or stops on its own)"
        );
    }

    #[test]
    fn a_step_sealed_after_its_last_answer_closes_at_the_seal() {
        let together = Together::default();
        together.join((1, 10));
        together.answered((1, 10), false);
        assert!(!all_answered(&together));
        together.seal();
        assert!(all_answered(&together));
    }
}
