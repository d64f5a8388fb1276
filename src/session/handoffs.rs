//! The registry of prepared hand-offs on one node: its offers' settings, and the logins it has
//! prepared for accounts offered to it, which an account task takes when it logs in after its
//! claim. The offers and the preparing are [`crate::handoff`]'s; the registry lives here, with
//! the account tasks that take from it, so the two modules depend one way.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::broker::PreparedLogin;

/// A prepared login as its account task receives it: `None` if the preparation failed.
pub(crate) type Ready = oneshot::Receiver<Option<Box<dyn PreparedLogin>>>;

/// A login prepared (or being prepared) for an offered account.
pub(crate) struct Entry {
    /// Which preparation this is (a later offer of the account replaces it).
    pub generation: u64,
    pub server: String,
    pub login: String,
    pub ready: Ready,
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

    /// This node's id (the sender of its offers).
    pub fn node_id(&self) -> &str {
        &self.node_id
    }

    /// A number for a new preparation, never given before.
    pub(crate) fn next_generation(&self) -> u64 {
        self.generation.fetch_add(1, Ordering::Relaxed)
    }

    /// How many logins are prepared or being prepared.
    pub(crate) fn held(&self) -> usize {
        self.prepared.lock().expect("prepared logins").len()
    }

    /// Keeps `entry` as `account_id`'s prepared login (replacing an earlier one).
    pub(crate) fn hold(&self, account_id: i64, entry: Entry) {
        self.prepared
            .lock()
            .expect("prepared logins")
            .insert(account_id, entry);
    }

    /// Drops `account_id`'s prepared login if it is still preparation `generation` (not taken,
    /// not replaced); true when it was.
    pub(crate) fn forget(&self, account_id: i64, generation: u64) -> bool {
        let mut prepared = self.prepared.lock().expect("prepared logins");
        let ours = prepared
            .get(&account_id)
            .is_some_and(|e| e.generation == generation);
        if ours {
            prepared.remove(&account_id);
        }
        ours
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

    /// Whether `account_id` has a prepared login (ready or under way), not taken yet.
    pub fn holds(&self, account_id: i64) -> bool {
        self.prepared
            .lock()
            .expect("prepared logins")
            .contains_key(&account_id)
    }

    /// The prepared login of `account_id` if it was made for `server` and `login` (taken: a
    /// second claim of the account logs in as usual).
    pub fn take(&self, account_id: i64, server: &str, login: &str) -> Option<Ready> {
        let mut prepared = self.prepared.lock().expect("prepared logins");
        let entry = prepared.remove(&account_id)?;
        (entry.server == server && entry.login == login).then_some(entry.ready)
    }
}
