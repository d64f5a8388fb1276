//! Prepared hand-offs (fair share, and a shutdown's): the receiving node logs the account in ahead of the release,
//! while the old owner still copies, so the new owner's first order waits for a fence raise and
//! its reads instead of a whole broker login (hundreds of milliseconds on a real trade server).
//!
//! Nothing here grants or reserves anything: the old owner O offers the account on
//! [`crate::channels::HANDOFF`] to the node it expects to claim it (the most starved peer), keeps
//! copying with its gate open until that node answers or [`Handoffs::wait`] passes, then stops
//! as before (gate closed, orders in flight finished, release committed and announced). The
//! claim is today's: whoever claims first wins. The receiver R logs in **without a fence** (the
//! old owner's orders still pass at a fencing server) and holds the login; R's account task,
//! once its claim committed, raises the fence to its epoch with the bridge's `fence` request and
//! then runs its whole session start (positions, orders, history, ledger) as after any login: a
//! prepared login saves the login, never a read. A login nobody claims is logged out after
//! [`KEPT`]; a broker that cannot prepare (FIX, a bridge without `fence`) leaves today's path.
//!
//! What keeps two owners from both sending is unchanged: R can send nothing before its claim
//! (the prepared login is not a [`crate::broker::Session`] until raised), and its claim cannot
//! commit before O's release. A SIGTERM hand-off is prepared the same way, one offer per account
//! to the peer that will take it ([`crate::lease::Core::begin_shutdown`]); each account's gate
//! closes once its receiver answered, and it is released on its own.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
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

/// How long a prepared login waits for its account's claim before it is logged out.
pub const KEPT: Duration = Duration::from_secs(10);

/// The most logins a node holds prepared at once (offers beyond it are answered unprepared).
const MAX_PREPARED: usize = 256;

/// The longest a prepared login may take (a slower broker gets no preparation).
const PREPARE_WITHIN: Duration = Duration::from_secs(10);

/// A prepared login as its account task receives it: `None` if the preparation failed.
pub type Ready = oneshot::Receiver<Option<Box<dyn PreparedLogin>>>;

struct Entry {
    generation: u64,
    server: String,
    login: String,
    ready: Ready,
}

/// One node's side of prepared hand-offs: its offers (as old owner) and its prepared logins
/// (as receiver).
pub struct Handoffs {
    node_id: String,
    /// How long an offered account keeps copying here for the receiver's answer (zero: no
    /// offers).
    wait: Duration,
    prepared: Mutex<HashMap<i64, Entry>>,
    generation: AtomicU64,
}

impl std::fmt::Debug for Handoffs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handoffs")
            .field("node_id", &self.node_id)
            .field("wait", &self.wait)
            .finish()
    }
}

impl Handoffs {
    /// `wait` zero turns offers off (the node still prepares what peers offer it).
    pub fn new(node_id: impl Into<String>, wait: Duration) -> Self {
        Handoffs {
            node_id: node_id.into(),
            wait,
            prepared: Mutex::new(HashMap::new()),
            generation: AtomicU64::new(1),
        }
    }

    /// How long an offered account keeps copying here at most.
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// Accounts with a prepared login (ready or under way).
    pub fn prepared(&self) -> Vec<i64> {
        let mut ids: Vec<i64> = self
            .prepared
            .lock()
            .expect("prepared logins")
            .keys()
            .copied()
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The prepared login of `account_id` if it was made for `server` and `login` (taken: a
    /// second claim of the account logs in as usual).
    pub fn take(&self, account_id: i64, server: &str, login: &str) -> Option<Ready> {
        let mut prepared = self.prepared.lock().expect("prepared logins");
        let entry = prepared.remove(&account_id)?;
        (entry.server == server && entry.login == login).then_some(entry.ready)
    }
}

/// Offers `account_id` to `to` and waits, the session still copying, for `to`'s answer, at most
/// [`Handoffs::wait`], or until `stopped` fires (the session was stopped for good: shutdown, a
/// lost lease). True when `to` answered.
pub async fn offer(
    node: &NodeServices,
    account_id: i64,
    to: &str,
    stopped: &CancellationToken,
) -> bool {
    let handoffs = &node.handoffs;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let wait = async {
        let _subscription = node.hub.subscribe(Topic::Handoffs, tx).await?;
        let offer = Handoff {
            ready: false,
            account_id,
            from: handoffs.node_id.clone(),
            to: to.to_string(),
        };
        if let Err(e) = node
            .db
            .run(async |c| db::lease::announce_handoff(c, &offer.payload()).await)
            .await
        {
            warn!(account_id, to, error = %db::describe(&e), "could not offer the account to the receiving node; handing it off unprepared");
            return None;
        }
        while let Some(signal) = rx.recv().await {
            if let Signal::Handoff(h) = signal
                && h.ready
                && h.account_id == account_id
                && h.to == to
            {
                return Some(());
            }
        }
        None
    };
    tokio::select! {
        answered = tokio::time::timeout(handoffs.wait, wait) => {
            let answered = matches!(answered, Ok(Some(())));
            if !answered {
                info!(account_id, to, wait_ms = handoffs.wait.as_millis() as u64, "the receiving node did not answer the hand-off offer in time; handing off anyway");
            }
            answered
        }
        _ = stopped.cancelled() => false,
    }
}

/// Runs the receiving side until `shutdown`: prepares a login for every account offered to this
/// node, answers the offer, and logs out what is not claimed within [`KEPT`]. A node shutting
/// down answers at once and prepares nothing.
pub async fn serve(node: std::sync::Arc<NodeServices>, shutdown: CancellationToken) {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let Some(_subscription) = node.hub.subscribe(Topic::Handoffs, tx).await else {
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

/// Prepares one offered account's login, answers the offer, and drops the login if nobody took
/// it within [`KEPT`].
async fn prepare(node: &NodeServices, offer: &Handoff, shutdown: &CancellationToken) {
    let account_id = offer.account_id;
    let handoffs = &node.handoffs;
    let generation = handoffs.generation.fetch_add(1, Ordering::Relaxed);
    let (done, ready) = oneshot::channel();
    let started = tokio::time::Instant::now();
    let prepared = async {
        if shutdown.is_cancelled() {
            anyhow::bail!("this node is shutting down");
        }
        let held = handoffs.prepared.lock().expect("prepared logins").len();
        if held >= MAX_PREPARED {
            anyhow::bail!("{held} logins already prepared (at most {MAX_PREPARED})");
        }
        let row = node
            .db
            .run(async |c| db::copy::load_account(c, account_id).await)
            .await
            .context("reading the account row")?
            .with_context(|| format!("account {account_id} no longer exists"))?;
        let password = row
            .credentials
            .as_ref()
            .map(|stored| credentials::decrypt(node.credentials_key.as_ref(), stored))
            .transpose()
            .with_context(|| format!("account {account_id} cannot log in to {}", row.server))?;
        handoffs.prepared.lock().expect("prepared logins").insert(
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
        let login = tokio::time::timeout(PREPARE_WITHIN, broker.prepare(&account))
            .await
            .map_err(|_| anyhow::anyhow!("no login within {PREPARE_WITHIN:?}"))??;
        Ok(login)
    };
    let outcome: anyhow::Result<Box<dyn PreparedLogin>> = prepared.await;
    let login_ms = started.elapsed().as_millis() as u64;
    match outcome {
        Ok(login) => {
            info!(
                account_id,
                from = %offer.from,
                login_ms,
                "hand-off offered: logged in ahead of the claim (no fence: nothing can be sent until the claim raises it)"
            );
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
            let mut prepared = handoffs.prepared.lock().expect("prepared logins");
            if prepared
                .get(&account_id)
                .is_some_and(|e| e.generation == generation)
            {
                prepared.remove(&account_id);
            }
            drop(prepared);
            let _ = done.send(None);
        }
    }
    let answer = Handoff {
        ready: true,
        ..offer.clone()
    };
    if let Err(e) = node
        .db
        .run(async |c| db::lease::announce_handoff(c, &answer.payload()).await)
        .await
    {
        debug!(account_id, error = %db::describe(&e), "could not answer the hand-off offer (the old owner stops waiting at its bound)");
    }
    tokio::select! {
        _ = tokio::time::sleep(KEPT) => {}
        _ = shutdown.cancelled() => {}
    }
    let mut prepared = handoffs.prepared.lock().expect("prepared logins");
    if prepared
        .get(&account_id)
        .is_some_and(|e| e.generation == generation)
    {
        prepared.remove(&account_id);
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
